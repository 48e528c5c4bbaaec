"""LoRA adapters: PEFT files, the slot table, and their use in a forward."""
