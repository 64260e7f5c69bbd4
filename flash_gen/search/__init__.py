"""The autotuner (`flash-gen tune`): search spaces and buckets, the Optuna-driven search, and the tuned database."""
