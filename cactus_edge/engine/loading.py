"""Loading an engine's models: names resolved through the catalog, the pair checked to share a
tokenizer before any weights load, the target local or spread over RPC workers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..catalog.resolve import resolve_model_path
from ..errors import InvalidSettingError
from ..llama import DEFAULT_N_CTX
from ..llama.devices import AUTO, resolve_gpu_layers
from ..llama.gguf import check_pair_compatible, read_gguf
from ..llama.library import set_verbose
from ..llama.model import LlamaModel, Model


class ForeignTokens(dict):
    """Target ids the draft's vocabulary lacks (the target's is up to 128 tokens larger), fed to
    the draft as the first draft token of the same text: the draft's cache keeps one position per
    committed token, and its drafts only need to be good, not exact (SpS stays lossless)."""

    def __init__(self, draft: Model, target: Model) -> None:
        super().__init__()
        self.draft, self.target = draft, target

    def __missing__(self, token: int) -> int:
        text = self.target.detokenize([token], special=True)
        ids = self.draft.tokenize(text, add_special=False, parse_special=True) if text else []
        self[token] = ids[0] if ids else max(self.draft.eos_token, 0)
        return self[token]


def load_models(
    draft: str | Path | None,
    target: str | Path,
    *,
    n_ctx: int = DEFAULT_N_CTX,
    n_threads: int | None = None,
    n_gpu_layers: int | str = AUTO,
    verbose: bool = False,
    rpc_servers: str | Sequence[str] | None = None,
    tensor_split: Sequence[float] = (),
    rpc_timeout: float | None = None,
) -> tuple[Model, Model | None]:
    """(target, draft) loaded from paths or registered names. The pair is checked to share a
    tokenizer before any weights are loaded; a failure frees whatever was loaded.

    rpc_servers: "host:port" workers (a list or one comma-separated string) that hold the
        target's layers (:class:`RemoteLlamaModel`, ``tensor_split`` their shares, ``rpc_timeout``
        seconds per call); the draft always runs here."""
    set_verbose(verbose)
    target_path = resolve_model_path(target)
    target_info = read_gguf(target_path, tokens=draft is not None)
    draft_info = None
    if draft is not None:
        draft_info = read_gguf(resolve_model_path(draft), tokens=True)
        check_pair_compatible(draft_info, target_info)
    layers = resolve_gpu_layers(n_gpu_layers)  # checked before anything loads
    settings = {"n_ctx": n_ctx, "n_threads": n_threads, "n_gpu_layers": layers}
    if rpc_servers:
        settings["n_gpu_layers"] = 0 if n_gpu_layers == AUTO else layers  # 0: every layer on the workers
        target_model = _remote_target(
            target_path, target_info, settings, rpc_servers, tensor_split, rpc_timeout, verbose
        )
        settings["n_gpu_layers"] = 0  # the draft stays on this machine's CPU
    elif tensor_split:
        raise InvalidSettingError("tensor_split needs rpc_servers", param="tensor_split")
    else:
        target_model = LlamaModel(target_path, info=target_info, **settings)
    try:
        draft_model = LlamaModel(draft_info.path, info=draft_info, **settings) if draft_info else None
    except BaseException:
        target_model.close()
        raise
    return target_model, draft_model


def _remote_target(path, info, settings, rpc_servers, tensor_split, timeout, verbose) -> Model:
    from ..llama.remote import DEFAULT_RPC_TIMEOUT, RemoteLlamaModel

    return RemoteLlamaModel(
        path,
        info=info,
        rpc_servers=rpc_servers,
        tensor_split=tensor_split,
        timeout=timeout or DEFAULT_RPC_TIMEOUT,
        verbose=verbose,
        **settings,
    )
