"""`ivcloud vm` (QEMU guests on an ivshmem-server) and `ivcloud pin`
(vCPU threads to host cores): image.py builds the guest, qemu.py starts
it and speaks QMP, agent.py runs commands inside it,
lifecycle.py boots, finds, pins and stops them; the command line is
ivcloud/cli/vm.py."""
