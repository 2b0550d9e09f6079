"""Model presets, family adapters and layout-independent construction."""
