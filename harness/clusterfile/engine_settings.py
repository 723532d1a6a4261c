"""``bundled.router`` and ``bundled.engine`` as typed models, made from the engine's own config
dataclasses (:class:`~harness.engine.pd.router_config.RouterConfig`,
:class:`~harness.engine.core.config.EngineConfig`; the engine is a lower layer), so a knob added
there is a cluster-file field here, in the printed JSON Schema too, without a second list to keep.

The models check each value's type; the engine's own ``__post_init__`` checks ranges and how
values go together, and its error becomes the field's (``FILE: field `bundled.engine.block_size`:
...``). Only the keys a file sets reach the engine (``model_dump(exclude_unset=True)``): a preset's
own defaults stay the engine's to choose.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import create_model, model_validator

from harness.checklists.validation import FieldProblem, StrictModel, did_you_mean, field_with_fix
from harness.engine.core.config import PRESETS, EngineConfig
from harness.engine.pd.router_config import RouterConfig
from harness.errors import ConfigError

# EngineConfig fields the harness sets per worker, never a cluster file: key -> where it comes from
ENGINE_RESERVED = {"preset": "bundled.preset", "name": "the worker id"}


def _fix_for(name: str, annotation: Any) -> str:
    if annotation is bool:
        return f"set {name}: true or false"
    if annotation is dict:
        return f"write `{name}: {{...}}` with the fields of docs/pd.md"
    return f"set {name} to a {'whole number' if annotation in (int, int | None) else 'plain value'} (docs/pd.md)"


def _fields_of(config: type, exclude: dict[str, str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """``config``'s dataclass fields as pydantic fields, in name order (the order a fix lists them)."""
    hints = typing.get_type_hints(config)
    out = {}
    for f in sorted(dataclasses.fields(config), key=lambda f: f.name):
        if f.name in exclude:
            continue
        default = ({"default_factory": f.default_factory} if f.default_factory is not dataclasses.MISSING
                   else {"default": f.default})
        out[f.name] = (hints[f.name], field_with_fix(_fix_for(f.name, hints[f.name]), **default))
    return out


def engine_problem(exc: Exception, default_fix: str) -> FieldProblem:
    """The engine's own config error as the cluster file's (the field is named by the caller)."""
    fix = getattr(exc, "fix", None)
    problem = str(exc).removesuffix(f" (fix: {fix})") if fix else str(exc)
    return FieldProblem(problem, fix or default_fix)


class _RouterBase(StrictModel):
    @model_validator(mode="after")
    def _router_accepts(self) -> "_RouterBase":
        try:
            RouterConfig.from_dict(self.model_dump(exclude_unset=True))
        except (ConfigError, TypeError, ValueError) as exc:
            raise engine_problem(exc, "see RouterConfig in harness/engine/pd/router_config.py") from None
        return self


class _EngineBase(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _not_reserved(cls, data: Any) -> Any:
        for key in ENGINE_RESERVED:
            if isinstance(data, dict) and key in data:
                raise FieldProblem(f"is set by the harness ({ENGINE_RESERVED[key]})",
                                   "remove it" + ("; set bundled.preset instead" if key == "preset" else ""),
                                   field=key)
        return data


RouterSettings = create_model("RouterSettings", __base__=_RouterBase, __doc__=(
    "The bundled router's knobs (RouterConfig), sabotage included: `reschedule_enabled: false` proves "
    "a suite fails on a cluster that does not reschedule."), **_fields_of(RouterConfig))
EngineSettings = create_model("EngineSettings", __base__=_EngineBase, __doc__=(
    "EngineConfig fields of every bundled worker (the preset is bundled.preset)."),
    **_fields_of(EngineConfig, tuple(ENGINE_RESERVED)))


def check_engine(preset: str, engine: StrictModel) -> None:
    """The preset exists and the engine runs it with these settings: each key alone (so the error
    names it), then all together. Raises FieldProblem relative to ``bundled``."""
    if preset not in PRESETS:
        raise FieldProblem(f"unknown model preset {preset!r}",
                           f"{did_you_mean(preset, PRESETS)}use one of {', '.join(sorted(PRESETS))} "
                           "(`python -m harness presets` lists them)", field="preset")
    values = engine.model_dump(exclude_unset=True)
    for field, given in [("preset", {}), *((f"engine.{k}", {k: v}) for k, v in values.items()), ("engine", values)]:
        try:
            EngineConfig(preset=preset, **given)
        except (ConfigError, TypeError, ValueError) as exc:
            problem = engine_problem(exc, "see EngineConfig in harness/engine/core/config.py")
            raise FieldProblem(problem.problem, problem.fix, field=field) from None
