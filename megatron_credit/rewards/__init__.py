"""Rewards: math verifiers, reward shaping, and the killable verifier worker processes.

| module | what lives there |
| --- | --- |
| ``base.py`` | ``RewardRecord``; the ``REWARD_FNS`` (method) and ``VERIFIER_BY_DATA_SOURCE`` registries |
| ``dapo.py`` | the DAPO "Answer:" verifier (Minerva normalisation, last 300 characters, ±1) |
| ``math.py`` | ``compute_score(response, ground_truth, *, method)``; the math-verify method |
| ``arith.py`` | the verifier of the synthetic arithmetic task |
| ``reasoning_gym.py`` | reasoning-gym's scorers (an optional dependency, imported at the first score) |
| ``shaping.py`` | overlong (DAPO), format and length penalties |
| ``verifier_workers.py`` | ``VerifierWorkers.score_batch``: per-item timeouts in processes that can be killed |
| ``verifier_worker.py`` | one verifier worker process (``python -m``; imports only the verifiers) |
| ``pool.py`` | the old import path of ``verifier_workers.py`` (its old names warn), for one release |

Importing this package imports nothing heavy; ``math-verify`` (sympy) loads on first use.
"""
