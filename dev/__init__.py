"""Tools for developers, outside the ``optima`` package (which never imports them). Run from the repository root:

python -m dev.demo                       # make demo: the iSFT CPU demo, then its time per iteration and report
python -m dev.times runs/demo_arc_sft    # the time per iteration of a finished iSFT run, and the busy share
python3 -m dev.gpu_check                 # make gpu-check: the GPU path on one NVIDIA GPU, PASS/FAIL per stage
"""
