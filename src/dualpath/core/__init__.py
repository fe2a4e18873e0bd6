"""Pure data shared by every layer: specs, presets, units, block hashing, analysis."""
