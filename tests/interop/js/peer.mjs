// A js-libp2p peer for the DCUtR interop test (tests/interop/test_dcutr_js.py, echo.tools.dcutr_js).
//
// Listens on TCP, reserves a slot on the circuit relay named on the command line and runs
// js-libp2p's own DCUtR service: when a peer reaches it through the relay, this side (the
// inbound one) starts the upgrade, as the spec says. It prints one JSON line per event
// ("@@ {...}") so the driver can tell a relayed connection from a direct one; it exits when
// stdin closes.
//
// Usage: node peer.mjs LISTEN_MULTIADDR RELAY_MULTIADDR [ANNOUNCE_MULTIADDR]
import './polyfill.mjs'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { circuitRelayTransport } from '@libp2p/circuit-relay-v2'
import { dcutr } from '@libp2p/dcutr'
import { identify } from '@libp2p/identify'

const [listen, relay, announce] = process.argv.slice(2)
const say = (obj) => process.stdout.write('@@ ' + JSON.stringify(obj) + '\n')

const node = await createLibp2p({
  addresses: {
    listen: [listen, `${relay}/p2p-circuit`],
    // The router's mapping of our listen port, which a go or rust peer learns from identify's
    // observed address; js-libp2p only trusts observed addresses once AutoNAT confirms them.
    appendAnnounce: announce ? [announce] : []
  },
  transports: [tcp(), circuitRelayTransport()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify(), dcutr: dcutr() }
})

const conn = (c) => ({ peer: c.remotePeer.toString(), addr: c.remoteAddr.toString(),
  direction: c.direction, relayed: c.remoteAddr.toString().includes('/p2p-circuit') })
node.addEventListener('connection:open', (e) => say({ event: 'open', ...conn(e.detail) }))
node.addEventListener('connection:close', (e) => say({ event: 'close', ...conn(e.detail) }))
node.addEventListener('self:peer:update', () => {
  const circuits = node.getMultiaddrs().map(String).filter((a) => a.includes('/p2p-circuit'))
  if (circuits.length > 0) say({ event: 'reserved', circuits })
})
say({ event: 'started', peer: node.peerId.toString(), addrs: node.getMultiaddrs().map(String) })

process.stdin.on('data', () => {})
process.stdin.on('end', async () => { await node.stop(); process.exit(0) })
