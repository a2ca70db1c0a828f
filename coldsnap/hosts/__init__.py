"""Transport to destination hosts (SSH or local) and the facts probed from them."""
