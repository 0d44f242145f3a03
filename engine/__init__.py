"""ssd_chat.engine: pure inference (no UI imports).  Code outside the engine imports only the names in
``__all__`` (docs/design.md groups them; ``tests/test_layout.py`` checks).  A name loads its module on first
use, so importing the package (the CLI does, to check settings) imports no torch."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {"events": "events", "processes": "processes", "threads": "threads", "simulate": "model.simulate",
            "model_cache": "load.store", "model_download": "load.pull"}
# name -> "module" (the same name there) or "module:name there"
_WHERE = {
    "DECODERS": "engine", "Engine": "engine",
    "MODES": "config", "CONFIG_MODES": "config", "EngineConfig": "config", "cache_dir": "config", "user_dir": "config",
    "DeviceError": "errors", "ModelError": "errors", "ParamError": "errors", "SSDChatError": "errors",
    "TokenizerMismatchError": "errors",
    "Done": "events", "Error": "events", "Event": "events", "Notice": "events", "Round": "events", "Stats": "events",
    "Token": "events", "mode_label": "events",
    "SamplingParams": "params", "MAX_LOGPROBS": "params", "SEED_MAX": "params",
    "DEFAULT_FAN_OUT": "fanout",
    "Metrics": "metrics", "over_ar_bound": "metrics", "ssd_over_sd_bound": "metrics",
    "ARDecoder": "decode.ar", "SDDecoder": "decode.sd", "SSDDecoder": "decode.ssd",
    "prompt_logprobs": "decode.logprobs:of_prompt",
    "messages_for": "load.chat", "prompt_ids": "load.chat", "CHAT_DEFAULT": "load.gen_defaults",
    "LoadedModel": "load.models", "ModelSpec": "load.names", "Placement": "load.models",
    "DEFAULT_TARGET": "load.models", "load_model": "load.models", "resolve_model": "load.names:resolve",
    "parse_placement": "load.models", "local_status": "load.models", "load_tokenizer": "load.models",
    "tokenizer_folder": "load.models", "CONVERTED_MARKER": "load.convert:MARKER", "content_hash": "load.convert",
    "check_forms": "load.placement", "parse_devices": "load.placement", "check_pair": "load.pair:check",
    "load_with_precision": "load.precision", "precision_of": "load.precision:of",
    "planned_precision": "load.precision:planned", "num_params": "load.precision", "tensor_key": "load.precision",
    "prepare_fast_linears": "cpu.fastlinear:prepare",
    "load_sharded": "tp.load", "draft_base": "tp.load",
    "preflight": "startup.preflight:check", "draft_kind": "startup.preflight", "in_force": "startup.preflight",
    "probe_in_config": "startup.probe:in_config", "probe_listed": "startup.probe:listed",
    "probe_key_fields": "startup.probe_store:key_fields", "probe_measuring": "startup.probe_store:measuring",
    "default_draft": "drafts.shipped", "check_draft_for_mode": "drafts.shipped", "is_derived": "drafts.shipped",
    "derive_draft": "drafts.shipped:derive", "derive_in_precision": "drafts.gguf:derive",
    "drafter": "drafts.drafter", "FeatureDraft": "drafts.feature", "check_fuse_layer": "drafts.feature",
    "is_feature_draft": "drafts.feature", "DRAFT_FORMAT": "drafts.folder:FORMAT",
    "DRAFT_MANIFEST": "drafts.folder:MANIFEST", "DRAFT_VERSION": "drafts.folder:VERSION", "DRAFT_WEIGHTS": "drafts.folder:WEIGHTS",
    "DraftShape": "drafts.model", "ReducedHead": "drafts.model", "build_draft": "drafts.model:build",
    "check_draft_shape": "drafts.model:check_shape", "shared_hash": "drafts.model", "trainable_state": "drafts.model",
    "Runner": "model.runner", "hidden_of": "model.layout", "output_module": "model.layout",
    "layer_parts": "model.layout:parts", "shallow": "model.layout",
}
__all__ = sorted([*_WHERE, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{_MODULES[name]}")
    if name in _WHERE:
        module, _, there = _WHERE[name].partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), there or name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
