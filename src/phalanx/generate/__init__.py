"""Sharded, resumable batch generation of training data (`phalanx generate`).

prompts.py reads prompt rows the way training reads data; sampling.py gives every (prompt,
sequence) its own random stream; engine.py decodes batches with the KV cache; job.py plans the
batches and builds the records; shards.py commits, resumes and merges; command.py is the CLI.
"""
