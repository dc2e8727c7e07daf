"""Tensor parallelism's process-group side: the rank's place in the group (`parallel_state`) and the collectives a
step makes (`collectives`). The offline `LLM`'s rank processes are worker/rank_processes.py."""
