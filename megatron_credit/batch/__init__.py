"""The batch the samples become, in one place: from a rollout's padded samples to the micro-batches a
forward pass reads.

| module | what lives there |
| --- | --- |
| ``train_batch.py`` | ``TrainBatch`` (label space, side channels, policy versions) and its micro-batch views |
| ``microbatch.py`` | token-budget micro-batches, shared by the old-log-prob pass and the update |
| ``rows.py`` | a mini-batch's rows cut into micro-batches, and their outputs copied back into the rows |
| ``packing.py`` | packing a micro-batch's sequences end to end (THD) and where each token lives |
| ``ragged.py`` | a mixture of experts' routing, one tensor per sample until a micro-batch gathers its rows |
| ``cp_chunks.py`` | megatron's load-balanced context-parallel split of a sequence (pure index math) |
| ``context_parallel.py`` | the CP split and merge of tensors over a process group |

It sits low in the house: it imports torch and nothing of the project outside this folder (megatron's
``PackedSeqParams`` loads lazily, on the actor's side), so ``credit/``, ``models/`` and ``algorithm/``
use it as freely as the trainer. Importing this package imports nothing.
"""
