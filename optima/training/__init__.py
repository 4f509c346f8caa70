"""Fine-tuning: handbook-style TRL scripts (run in the training env) and their launcher (run by the driver)."""
