"""An emulated AWS on this machine that SkyPilot's real AWS provisioner runs against.

moto's server is the EC2/IAM/STS endpoint; a fault front before it does what AWS does
and moto does not (capacity errors, spot stops refused, spot interruptions); a
hypervisor turns every instance moto starts into a host of its own (network, mount,
PID and UTS namespaces at the instance's private IP, running sshd with the key of its
UserData, with its own home and its own metadata at 169.254.169.254); the SkyPilot side
(``skyconf``, ``runtime``) prepares SkyPilot's client home and the nodes' offline
runtime. One command starts it all::

    python -m orchestrator.awsemu up --home DIR

and tests use the same entry, :func:`orchestrator.awsemu.emulator.start`. See
docs/awsemu.md.
"""
