"""medseg.distributed.secure: what protects the traffic between hospitals.

:mod:`.tunnel`: the site link, a WireGuard tunnel (user-space ``wireguard-go``) that medseg keys,
configures, brings up and tears down, so that every socket of a job can bind to a tunnel address and
the only port a site opens to the WAN is the tunnel's UDP port.
"""
