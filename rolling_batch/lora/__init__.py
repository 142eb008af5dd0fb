"""LoRA adapters: reading PEFT folders (adapters.py), the slots a step uses (manager.py), and
the record of the adapters served for the management API (registry.py)."""
