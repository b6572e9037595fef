"""What an RL algorithm is: an ``Algorithm`` built from its typed ``Config`` (``base``), one file per family
(``grpo``: GRPO, Dr.GRPO, RLOO, DAPO, GSPO; ``fipo``; ``ppo``; ``comppo``), the names a recipe picks from
(``catalog``), what an algorithm reads inside the forward pass (``capture``), the trainer's knobs it may move
(``knobs``) and CompPO's phase controller that moves them (``phase``), the critic kinds and gate controls a recipe selects (``critic_kinds``, ``gate_controls``).
What it logs is declared in ``megatron_credit/metrics/tables.py``. A user registers one through ``--plugin`` (``megatron_credit/plugins.py``)."""
