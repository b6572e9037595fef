"""``openenv_targets.py`` imports OpenEnv (``openenv-core``, the ``openenv`` extra): without it, ``make test``'s
``--doctest-modules`` must not import that module (its tests skip with their reason)."""
import importlib.util

collect_ignore = [] if importlib.util.find_spec("openenv") is not None else ["openenv_targets.py"]
