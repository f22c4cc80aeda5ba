"""Fusion-first Keras layers.

Each layer emits exactly the op pattern grappler's remapper fuses (see
`tfmetal_ext.inspect.PATTERNS`) and registers a rule with the inspection
catalog so fusion reports know what to expect from it.
"""
