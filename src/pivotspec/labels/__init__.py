"""Pivot labels: walk a problem with the draft, roll out the target after each draft token and after the
target's own choice, and call the draft token a pivot when it lowers the task's utility (the PAD paper's
self-supervised labels).

Owns the walk and its rules (``walk``), the rollout engines that sample continuations (``rollouts``: torch, or
vLLM in its own process through ``vllm_worker``), labels files and shards (``files``) and the Ray launcher
(``cluster``). It imports the decoding core, the tasks and the base; never the classifier, evaluation or an
entry point.
"""
