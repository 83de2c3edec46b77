"""`hkstore generate STORE "prompt"`: a completion from a decoder store, streamed as it is made.

    hkstore generate STORE "the history of" --max-tokens 32 --temperature 0.8 --top-p 0.95 --seed 1
    hkstore generate STORE "..." --json          # the whole result (ids, text, finish_reason, usage)

The prompt runs through PLOT lookups and the upper layers (runtime.gen); the store's
decoder (meta model_path) supplies the upper layers and the tokenizer; --tenant applies a
decoder tenant's lm PET (runtime.construct.decoder_tenant) and serves from its PLOT version.
"""

from __future__ import annotations

import json

import click


@click.command("generate")
@click.argument("store", type=click.Path(file_okay=False, exists=True))
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
    import hkstore
    from formats.errors import FormatError
    from hkstore.errors import StoreError
    from runtime.gen.batcher import Batcher
    from runtime.gen.sampling import SamplingParams
    from runtime.model.stored import base_decoder

    try:
        with hkstore.open(store) as st:
            snap = st.snapshot()
            dec = base_decoder(st)
            pet = None
            if tenant is not None:
                from runtime.model.stored import load_lm_pet

                if tenant not in snap.pets:
                    raise ValueError(f"unknown tenant {tenant!r}")
                pet = load_lm_pet(st, tenant, dec)
                version = version or pet.meta.get("version") or snap.read_pet(tenant).meta.get("version")
            gen = _generator(snap, version or snap.version_names[0], dec, device)
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                    max_tokens=max_tokens, stop=list(stop))
            batcher = Batcher(gen, kv_budget_bytes=1 << 40, max_running=1)
            rid = batcher.submit(gen.decoder.tokenize([prompt])[0], params, pet)
            shown = ""
            while batcher.busy:
                for event in batcher.step():
                    if not as_json and event.text.startswith(shown) and len(event.text) > len(shown):
                        click.echo(event.text[len(shown):], nl=False)
                        shown = event.text
    except (StoreError, FormatError, ValueError, OSError) as e:
        raise click.ClickException(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
    result = batcher.result(rid)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        click.echo("")


def _generator(snap, version, decoder, device):
    from runtime.exec.gpu import cuda_available

    if device == "cuda" and not cuda_available():
        raise ValueError("--device cuda: no CUDA GPU with CuPy here (pip install 'hkstore[gpu]'); use --device cpu")
    if device == "cuda" or (device == "auto" and cuda_available()):
        from runtime.gen.device_decode import DevicePlotDecoder

        return DevicePlotDecoder(snap, version, decoder)
    from runtime.gen.plot_decode import PlotDecoder

    return PlotDecoder(snap, version, decoder)
