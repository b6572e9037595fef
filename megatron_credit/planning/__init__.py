"""The memory planner: does a recipe's layout fit its cluster (``plan``), which layouts would
(``layouts``), how long an iteration and a run take (``timing``), and the checks before a run (``preflight``);
the GPU kinds a recipe may be sized for are ``megatron_credit.gpu_kinds``."""
