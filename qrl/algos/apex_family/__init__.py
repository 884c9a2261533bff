"""The Ape-X family's base (Ape-X, Ape-X DPG, R2D2 share it): the replay's config fields, the
replay role of a builder, the experience and frame schemas. Its actor and learner bases are
qrl/actors/replay.py and qrl/learners/replay.py; the replay itself is qrl/replay/."""
