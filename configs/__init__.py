"""ml-collections configs: `base.py` (every field) and the correction presets."""
