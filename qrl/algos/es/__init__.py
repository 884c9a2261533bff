"""Evolution Strategies (Salimans et al. 2017): config, builder, message schemas, key names and
the search's maths; its worker and master are qrl/actors/es.py and qrl/learners/es.py."""
