"""The embedded testbed: the ``arith`` task, a fine-tuned SmolLM2 target and a small draft."""
