"""tensorflow-datasets builders (array_record format, no TensorFlow needed), one module each.

Import the module you need (e.g. ``data.tfds_builders.criteo``); importing one registers its
builder with tfds. This package imports none of them, so each stays optional.
"""
