"""The libp2p node of a daemon: host (Noise + yamux), Kademlia DHT, circuit relay, AutoNAT and hole
punching, typed message streams over libp2p streams, the daemon's persistent identity, and the
process's compute thread (where every torch pass runs: compute_thread).

Every py-libp2p quirk lives here, so the rooms above speak of peers, protocols and streams. May
import wire (and peerd.paths / peerd.__version__); never another room of peerd.
"""
