"""Ray at the edges: the only package that imports ray. Workers stay plain classes; this layer runs
them as actors with resources taken from config."""
