"""Built-in launch profiles (TOML files), shipped inside the wheel as ninfer_tui.builtin_profiles."""
