"""The BMv2 backend: ncina's P4 program (``p4/``) on ``simple_switch_grpc``, its generator,
toolchain detection, switch process and P4Runtime control plane (docs/bmv2.md)."""
