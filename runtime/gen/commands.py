"""`hkstore generate STORE "prompt"`: a completion from a decoder store, streamed as it is made.

    hkstore generate STORE "the history of" --max-tokens 32 --temperature 0.8 --top-p 0.95 --seed 1
    hkstore generate STORE "..." --json          # the whole result (ids, text, finish_reason, usage)

The prompt runs through PLOT lookups and the upper layers in the runtime's generation engine
(runtime.gen.engine, the one runtime.open(...).generate and hkstore serve use); the store's
decoder (meta model_path) supplies the upper layers and the tokenizer; --tenant applies a
decoder tenant's lm PET (runtime.construct.decoder_tenant) and serves from its PLOT version.
"""

from __future__ import annotations

import json

import click


@click.command("generate")
@click.argument("store")
@click.argument("prompt")
@click.option("--version", default=None, help="PLOT version (default: the tenant's, else the root).")
@click.option("--tenant", default=None, help="A decoder tenant (an lm PET, hkstore tenant create on a decoder store).")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0: no cut.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop sequence (repeat for more, at most 4).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="cuda: the upper layers, KV cache and PET on the GPU executor (auto: when CuPy sees a GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of streaming text.")
def generate(store, prompt, version, tenant, max_tokens, temperature, top_k, top_p, seed, stop, device, as_json):
    """Complete PROMPT with the decoder store STORE (greedy unless --temperature)."""
    from formats.errors import FormatError
    from hkstore.errors import StoreError
    from runtime.gen.api import DecoderRuntime

    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_k": top_k,
               "top_p": top_p, "seed": seed, "stop": list(stop)}
    if tenant is not None:
        request["tenant"] = tenant
    if version is not None:
        request["version"] = version
    result, shown = None, ""
    try:
        with DecoderRuntime(store, _device(device)) as rt:  # the engine every caller shares (runtime.gen.engine)
            for event in rt.generation_engine().submit([request]).events():
                if event["type"] == "error":
                    raise event["error"]
                if event["type"] != "token":
                    continue
                if not as_json and event["text"].startswith(shown) and len(event["text"]) > len(shown):
                    click.echo(event["text"][len(shown):], nl=False)
                    shown = event["text"]
                if event["finished"]:
                    result = event["result"]
    except (StoreError, FormatError, ValueError, OSError) as e:
        raise click.ClickException(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        click.echo("")


def _device(device) -> str:
    from runtime.exec.gpu import cuda_available

    if device == "cuda" and not cuda_available():
        raise click.ClickException("--device cuda: no CUDA GPU with CuPy here (pip install 'hkstore[gpu]'); "
                                   "use --device cpu")
    return "cuda" if device == "cuda" or (device == "auto" and cuda_available()) else "cpu"
