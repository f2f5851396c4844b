//! RDMA_HELLO: sets up a connection's RDMA endpoint, connected to the client's, when the server
//! runs RDMA with the client's provider and has an endpoint to spare. A refusal says why, and
//! the connection goes on over TCP.

use memkv_fabric::Endpoint;
use memkv_proto::{self as proto, Header};

use crate::conn::{Conn, End};
use crate::rdma::RdmaPeer;
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn rdma_hello(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let (prov, addr) = proto::decode_rdma_hello(body)?;
        let answer = match &self.ctx.rdma {
            None => Err("RDMA is off on this server (start it with --rdma)".to_string()),
            Some(sf) if sf.fab.hello_name != prov => Err(format!(
                "the server's libfabric provider is {:?}, the client's {prov:?}",
                sf.fab.hello_name
            )),
            Some(sf) => sf
                .endpoint_slot()
                .ok_or_else(|| {
                    format!(
                        "the server's RDMA connections are at their bound ({}, \
                         --max-rdma-connections)",
                        sf.max_endpoints()
                    )
                })
                .and_then(|slot| {
                    let ep = Endpoint::open(&sf.fab)
                        .map_err(|e| format!("cannot open an endpoint: {e}"))?;
                    Ok((ep, slot))
                })
                .and_then(|(mut ep, slot)| {
                    // The provider reads an address of its own format from what we hand it
                    // (a fixed length, or up to a NUL for shm's names): one it would read
                    // past is refused, never handed over.
                    let own = ep.name().map_err(|e| e.to_string())?;
                    sf.fab.peer_address_ok(own.len(), addr)?;
                    let peer = ep
                        .insert_peer(addr)
                        .map_err(|e| format!("cannot reach the client's endpoint: {e}"))?;
                    Ok(RdmaPeer {
                        ep,
                        peer,
                        _slot: slot,
                    })
                }),
        };
        let reply = match answer {
            Ok(p) => {
                self.rdma = Some(p);
                proto::encode_rdma_hello_reply(true, "")
            }
            Err(why) => {
                self.ctx.store.metrics.error("rdma_refused");
                proto::encode_rdma_hello_reply(false, &why)
            }
        };
        self.reply(h, &reply)
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;

    use memkv_proto::{self as proto, Opcode, Status, FLAG_RDMA};

    use super::super::rdma_test_client::{call, connect, put, server, Peer};

    #[test]
    fn broken_handshakes_are_refused_and_the_server_stays_up() {
        let srv = server();
        let peer = Peer::new(4096);
        // An address of the wrong length is never handed to the provider.
        let (_, ok, why) = connect(&srv, &peer.provider, &[1, 2, 3]);
        assert!(!ok && why.contains("3-byte"), "{why}");
        // Another provider's client.
        let (_, ok, why) = connect(&srv, "verbs;ofi_rxm", &peer.name);
        assert!(!ok && why.contains("provider"), "{why}");
        // The same provider with rxm buffers of another size (a client with another
        // FI_OFI_RXM_BUFFER_SIZE, or of a memkv that did not set it): rxm would refuse the
        // server's connection to it and every transfer would stall until its deadline.
        let (_, ok, why) = connect(&srv, "tcp;ofi_rxm", &peer.name);
        assert_eq!(
            (ok, why.as_str()),
            (
                false,
                "the server's libfabric provider is \"tcp;ofi_rxm with 256-byte rxm buffers\", \
                 the client's \"tcp;ofi_rxm\""
            )
        );
        // A well-formed address nobody listens at: accepted, but a transfer fails as a value.
        let nobody = vec![0u8; peer.name.len()];
        let (mut s, ok, _) = connect(&srv, &peer.provider, &nobody);
        if ok {
            let st = put(&mut s, b"x", peer.desc(0, 100));
            assert!(st.is_none() || st == Some(Status::RemoteAccess), "{st:?}");
        }
        // An RDMA transfer before RDMA_HELLO: an error frame, then the connection closes.
        let mut s = TcpStream::connect(srv.addr).unwrap();
        call(&mut s, Opcode::Hello, 0, &[]).unwrap();
        let body = proto::encode_descriptors(&[b"k".as_slice()], &[peer.desc(0, 10)]);
        let (h, b) = call(&mut s, Opcode::Put, FLAG_RDMA, &body).unwrap();
        assert_eq!(h.opcode, Opcode::Error);
        assert!(proto::decode_error(&b)
            .unwrap()
            .1
            .contains("before RDMA_HELLO"));
        // Still serving.
        let (mut s, ok, why) = connect(&srv, &peer.provider, &peer.name);
        assert!(ok, "{why}");
        assert_eq!(put(&mut s, b"y", peer.desc(0, 100)), Some(Status::Ok));
        srv.shutdown();
        srv.wait();
    }
}
