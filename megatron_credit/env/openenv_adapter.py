"""``env.name: openenv``: an environment written for OpenEnv (PyPI ``openenv-core``) played by the rollout loop.

OpenEnv's environment is a Gym-style class, ``openenv.core.env_server.interfaces.Environment``, with
``reset(**kwargs) -> Observation`` and ``step(action) -> Observation``. Its ``Action`` and
``Observation`` are pydantic models of the environment's own fields; an observation carries ``done``
and ``reward`` (which an environment with a ``Rubric`` sets from it; a trajectory rubric gives its
score at the last step). The class runs in this process; the model never talks to it through a client:

- :meth:`OpenEnv.start` builds a new instance per episode (``env``, a ``module:factory`` import path,
  called with ``env_kwargs``): an OpenEnv environment holds one episode's state on itself, and the loop
  runs the steps of different episodes at once. It is reset with keyword arguments read from the prompt
  record (``reset_fields``, e.g. the target of a game from the record's ground truth).
- :meth:`OpenEnv.step` puts the turn's text (the ``end_texts`` removed from its end) into the
  ``action_field`` of the environment's ``action`` class, steps, and returns the observation's ``reward``
  (None: 0) and ``done``; the next observation's text is ``observation_text`` with ``{field}`` replaced by
  the observation's fields (for a chat model, the template's user-turn markers around them).

The reset observation is not shown to the model: the prompt is the data source's (docs/multi_turn.md,
"Environments from other libraries"). An instance is closed when its episode is done, when the loop drops
an episode that ended otherwise (the budget, EOS, ``env.max_turns``), or at :meth:`OpenEnv.close`.

The library is imported when the environment is built, never with the package: ``megatron_credit.env``
stays torch- and library-free.
"""
from __future__ import annotations

import importlib
import logging
import string
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

from megatron_credit.env.base import ENVIRONMENTS, Environment, StepResult

OPENENV_VERSION = "0.3.0"
INSTALL_HINT = f"pip install openenv-core=={OPENENV_VERSION}"
RECORD_FIELDS = ("ground_truth", "uid", "data_source", "prompt")
"""What ``reset_fields`` may read from a prompt record, besides ``extra_info.<key>``; ``prompt`` is the
content of the record's last message."""

log = logging.getLogger(__name__)


def import_openenv() -> tuple[type, type]:
    """OpenEnv's ``(Action, Observation)`` base classes, or one ``ValueError`` saying how to install it."""
    try:
        from openenv.core.env_server.types import Action, Observation
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "openenv":
            raise ValueError(f"env.name=openenv: importing openenv failed ({exc}); it needs `{INSTALL_HINT}` with "
                             "its dependencies") from None
        raise ValueError(f"env.name=openenv needs `{INSTALL_HINT}` (openenv is not installed)") from None
    except ImportError as exc:  # installed, but one of its own imports failed
        raise ValueError(f"env.name=openenv: importing openenv failed ({exc}); it needs `{INSTALL_HINT}` with its "
                         "dependencies") from None
    return Action, Observation


def import_path(ref: str, where: str) -> Any:
    """The object that ``"module:qualname"`` names; one ``ValueError`` naming ``where`` otherwise."""
    module_name, _, qualname = ref.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import {module_name!r} of {ref!r} ({exc})") from None
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: {module_name!r} has no {qualname!r} (from {ref!r})")
        obj = getattr(obj, part)
    return obj


def record_value(record: Any, source: str) -> Any:
    """What ``source`` (one of :data:`RECORD_FIELDS` or ``extra_info.<key>``) reads from a prompt record."""
    if source == "prompt":
        return record.messages[-1].content
    if source.startswith("extra_info."):
        return record.extra_info[source[len("extra_info."):]]
    return getattr(record, source)


class OpenEnvEpisode:
    """One episode's OpenEnv instance; its ``closer`` closes it once, when called or when the episode is
    dropped."""

    def __init__(self, env: Any, closer: "OpenEnv") -> None:
        self.env = env
        self.closer = weakref.finalize(self, closer._release, env)


@ENVIRONMENTS.register("openenv")
class OpenEnv(Environment):
    """An OpenEnv environment, one instance per episode (module docstring). Thread-safe across episodes."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Environment.Config):
        """The adapter's options (a recipe's ``env.options``)."""

        env: str = ""
        """The OpenEnv environment as ``"module:factory"``: its class, or a function that returns a new
        instance; called with ``env_kwargs`` once per episode."""
        env_kwargs: Mapping[str, Any] = field(default_factory=dict)
        """Keyword arguments of the factory."""
        action: str = ""
        """The environment's ``Action`` class as ``"module:Class"``."""
        action_field: str = "message"
        """The action's field that receives the turn's text."""
        reset_fields: Mapping[str, str] = field(default_factory=dict)
        """``reset`` keyword -> what it reads from the prompt record: ``ground_truth``, ``uid``,
        ``data_source``, ``prompt`` (the last message's content) or ``extra_info.<key>``."""
        observation_text: str = "{prompt}"
        """The next observation's text: ``{field}`` is the observation's ``field`` (pydantic fields, e.g.
        ``{prompt}``, ``{metadata[hint]}``)."""
        stop_texts: tuple[str, ...] = ()
        """Texts that end a turn besides EOS; each must be one token."""
        end_texts: tuple[str, ...] = ()
        """Texts removed from the end of a turn before it becomes the action: the tokenizer's EOS as text
        (``<|im_end|>``, ``</s>``)."""
        continues_after_eos: bool = True
        """A turn that ends on EOS gets its observation and a next turn (a chat model ends each turn so)."""

        def __post_init__(self) -> None:
            for name in ("env", "action"):
                ref = getattr(self, name)
                module_name, colon, qualname = ref.partition(":")
                if not (module_name and colon and qualname):
                    what = "environment as 'module:factory'" if name == "env" else "action as 'module:Class'"
                    raise ValueError(f"env.options.{name} must name the OpenEnv {what}, got {ref!r}")
            if not self.action_field.isidentifier():
                raise ValueError(f"env.options.action_field must be a field name, got {self.action_field!r}")
            for key, source in self.reset_fields.items():
                if not (source in RECORD_FIELDS or (source.startswith("extra_info.") and source != "extra_info.")):
                    raise ValueError(f"env.options.reset_fields.{key} must be one of {list(RECORD_FIELDS)} or "
                                     f"'extra_info.<key>', got {source!r}")
            try:
                names = [name for _, name, _, _ in string.Formatter().parse(self.observation_text)]
            except ValueError as exc:
                raise ValueError(f"env.options.observation_text is not a format string ({exc}): "
                                 f"{self.observation_text!r}") from None
            if "" in names:
                raise ValueError(f"env.options.observation_text must name observation fields, not '{{}}': "
                                 f"{self.observation_text!r}")
            for name in ("stop_texts", "end_texts"):
                if any(not t for t in getattr(self, name)):
                    raise ValueError(f"env.options.{name} must hold non-empty strings, got {list(getattr(self, name))}")

    def __init__(self, config: "OpenEnv.Config") -> None:
        super().__init__(config)
        self.config: OpenEnv.Config = config
        action_base, self._observation = import_openenv()
        self.factory = import_path(config.env, "env.options.env")
        if not callable(self.factory):
            raise ValueError(f"env.options.env: {config.env!r} is {type(self.factory).__name__}, not a class or "
                             "function that builds an environment")
        if getattr(self.factory, "REQUIRES_SINGLE_THREAD_EXECUTOR", False):
            raise ValueError(f"env.options.env: {config.env!r} sets REQUIRES_SINGLE_THREAD_EXECUTOR; its calls "
                             "would run on several step threads (env.step_threads), which it does not allow")
        self.action = import_path(config.action, "env.options.action")
        if not (isinstance(self.action, type) and issubclass(self.action, action_base)):
            raise ValueError(f"env.options.action: {config.action!r} is not a subclass of OpenEnv's Action")
        if config.action_field not in self.action.model_fields:
            raise ValueError(f"env.options.action_field: {self.action.__name__} has no field "
                             f"{config.action_field!r}; its fields: {sorted(self.action.model_fields)}")
        self.stop_texts = tuple(config.stop_texts)
        self.continues_after_eos = config.continues_after_eos
        self._lock = threading.RLock()  # a dropped episode's closer may run in a garbage collection under it
        self._live: dict[int, weakref.finalize] = {}  # id of an open instance -> its episode's closer

    def start(self, record: Any) -> OpenEnvEpisode:
        """A new instance, reset with the record's ``reset_fields``. Raises when the factory gives an
        instance another episode holds, or reset does not return an Observation."""
        env = self.factory(**self.config.env_kwargs)
        kwargs = {key: record_value(record, source) for key, source in self.config.reset_fields.items()}
        with self._lock:
            if id(env) in self._live:
                raise ValueError(f"env.options.env: {self.config.env!r} returned an instance that another "
                                 "episode holds; it must build a new one per call")
            episode = OpenEnvEpisode(env, self)
            self._live[id(env)] = episode.closer
        first = env.reset(**kwargs)
        if not isinstance(first, self._observation):
            raise TypeError(f"{type(env).__name__}.reset returned {type(first).__name__}, not an OpenEnv Observation")
        return episode

    def step(self, state: OpenEnvEpisode, action: str) -> StepResult:
        """One OpenEnv step on the turn's text (module docstring); what comes back is checked by the loop."""
        c = self.config
        text = action.rstrip()
        for end in c.end_texts:
            if text.endswith(end):
                text = text[: -len(end)]
        obs = state.env.step(self.action(**{c.action_field: text}))
        if not isinstance(obs, self._observation):
            raise TypeError(f"{type(state.env).__name__}.step returned {type(obs).__name__}, not an OpenEnv "
                            "Observation")
        reward = 0.0 if obs.reward is None else float(obs.reward) if isinstance(obs.reward, bool) else obs.reward
        if obs.done is True:
            state.closer()
            return StepResult(reward=reward, done=True)
        return StepResult(observation=self.render(obs), reward=reward, done=obs.done)

    def render(self, obs: Any) -> str:
        """``observation_text`` filled with ``obs``'s fields; a field it has not is one line naming them."""
        fields = dict(obs)
        try:
            return self.config.observation_text.format_map(fields)
        except (KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"env.options.observation_text names {exc}, which {type(obs).__name__} lacks; its "
                             f"fields: {sorted(fields)}") from None

    def close(self) -> None:
        """Close every instance still open (of episodes not done yet)."""
        with self._lock:
            closers = list(self._live.values())
        for closer in closers:
            closer()

    def _release(self, env: Any) -> None:
        """Close one episode's instance (its closer calls this once); a failing close is logged, not raised:
        the episode is over either way."""
        with self._lock:
            self._live.pop(id(env), None)
        try:
            env.close()
        except Exception as exc:  # noqa: BLE001  (any failure of a library's close)
            log.warning("openenv: %s.close() raised %s: %s", type(env).__name__, type(exc).__name__, exc)
