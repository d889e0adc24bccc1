"""Network lab: N hosts in network namespaces behind a bridge switch, with loss/rate/delay.

    from ltp_tools.netlab import Lab, check_support, LabUnsupported
    with Lab(n_hosts=3) as lab:
        lab.impair(lab.hosts[0], loss=0.01, rate_bps=1e9, delay_s=0.010)
        lab.run(lab.hosts[1], ["ping", "-c1", lab.hosts[0].addr])

See ``lab.py`` for the theory of operation (where each impairment lives and why).
"""
from .lab import Host, Impairment, Lab
from .support import DEFAULT_PREFIX, LabUnsupported, check_support, clean, delay_backend, list_netns, probe

__all__ = ["Lab", "Host", "Impairment", "LabUnsupported", "check_support", "clean", "delay_backend",
           "list_netns", "probe", "DEFAULT_PREFIX"]
