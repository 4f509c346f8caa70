"""Stage bodies of the training loops; ``optima.pipeline`` runs them under the iteration manifest."""
