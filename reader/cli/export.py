"""``python -m reader export``: the command line of the Megatron and flat-tokens writers (docs/INTEROP.md).

Apart from :mod:`reader.interop.export` (the shared reading and output helpers) so that the writers, which use
those helpers, are imported only by this command and never by each other's modules.
"""

from __future__ import annotations

import sys

def add_parser(sub) -> None:
    """The ``export`` subcommand of ``python -m reader``."""
    e = sub.add_parser(
        "export", help="write a cache as Megatron .bin/.idx or seqax flat-tokens (zarr)",
        description="Write a finished cache's documents, in global order, in another training-data format. "
                    "megatron: PREFIX.bin + PREFIX.idx (Megatron-Core IndexedDataset, one sequence per "
                    "document, dtype uint16 if vocab_size < 65500 else int32, as Megatron's "
                    "DType.optimal_dtype). flat-tokens: a zarr v2 group with train/ and validation/ flat-tokens "
                    "arrays (a cache directory with train/ and validation/ sub-caches fills both; a plain cache "
                    "fills train and leaves validation empty). megatron keeps the tokens as stored (EOS included "
                    "if the cache was built with --append_eos); flat-tokens leaves that EOS out (the format marks "
                    "sequence starts instead), unless --keep_eos. See docs/INTEROP.md.")
    e.add_argument("path", help="cache root (local path or gs://bucket/cache), or a directory holding train/ "
                                "and validation/ caches (flat-tokens)")
    e.add_argument("--format", required=True, choices=["megatron", "flat-tokens"], help="output format")
    e.add_argument("--out", required=True,
                   help="megatron: output prefix (writes OUT.bin and OUT.idx); flat-tokens: the zarr directory "
                        "(e.g. data.zarr)")
    e.add_argument("--overwrite", action="store_true", help="replace existing output files")
    e.add_argument("--dtype", choices=["auto", "uint16", "int32"], default="auto",
                   help="megatron: token dtype of the .bin (default auto: Megatron's rule from vocab_size)")
    e.add_argument("--tokens_chunk_size", type=int, default=1 << 22,
                   help="flat-tokens: zarr chunk length of encoded_tokens (default 4194304, as seqax)")
    e.add_argument("--seq_starts_chunk_size", type=int, default=1 << 20,
                   help="flat-tokens: zarr chunk length of seq_starts (default 1048576, as seqax)")
    e.add_argument("--threads", type=int, default=2,
                   help="chunks fetched and decoded ahead, in parallel (default 2; memory holds threads + 1 chunks)")
    e.add_argument("--keep_eos", action="store_true",
                   help="flat-tokens: keep the EOS that ends every document of a cache built with --append_eos "
                        "(by default it is left out: flat-tokens marks sequence starts with a bit instead)")
    e.set_defaults(fn=cmd_export)


def cmd_export(args) -> int:
    if args.format == "megatron":
        from reader.interop.megatron import export_megatron

        summary = export_megatron(args.path, args.out, overwrite=args.overwrite,
                                  dtype=None if args.dtype == "auto" else args.dtype, threads=args.threads)
    else:
        from reader.interop.flat_tokens import export_flat_tokens

        summary = export_flat_tokens(args.path, args.out, overwrite=args.overwrite,
                                     tokens_chunk_size=args.tokens_chunk_size,
                                     seq_starts_chunk_size=args.seq_starts_chunk_size, keep_eos=args.keep_eos,
                                     threads=args.threads)
    print(summary, file=sys.stdout)
    return 0
