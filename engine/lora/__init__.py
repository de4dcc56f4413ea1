"""LoRA adapters served from one base model, rows of several adapters in one step.

    adapter.py      an adapter read from PEFT's format and checked against the model
    slots.py        the stacked weights of the resident adapters, slot 0 the base model's zeros
    registry.py     which adapters are known and resident (LRU slots, pinned while in use), counters
    lora_linear.py  one step's low-rank updates, every row by its own slot
"""
