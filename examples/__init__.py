"""Programs that use peerd as its users would (`python -m examples.ptune`). A regular package on
purpose: py-libp2p installs a top-level `examples` package of its own, which would otherwise win
over this folder and make `python -m examples.ptune` fail with "No module named examples.ptune"."""
