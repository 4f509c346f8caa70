"""Training-data selection: the best conversations for SFT (``sft``), preference pairs for DPO (``dpo``)."""
