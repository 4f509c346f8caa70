"""What is trained on: the iSFT conversations (`sft`), the tree search (`mcts`, over the values of `tree`) and the
DPO pairs mined from it (`dpo`)."""
