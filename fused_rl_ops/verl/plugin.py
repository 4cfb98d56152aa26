"""Importing this installs fused_rl_ops.verl's default processor in verl's fused path (refused, with
the reason, on a verl it was not made for). verl imports the modules named in the environment
variable VERL_USE_EXTERNAL_MODULES in every process that imports verl, its Ray workers included:
VERL_USE_EXTERNAL_MODULES=fused_rl_ops.verl.plugin (docs/verl.md)."""
from fused_rl_ops.verl import install

install()
