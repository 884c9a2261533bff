-- KEYS gen; ARGV -, -, world: the forming generation, '' if none valid.
return current()
