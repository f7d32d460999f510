"""One module per model family: its config fields, its weight names (HF and GGUF, written once) and how its
layers are built from them. models/registry.py lists them."""
