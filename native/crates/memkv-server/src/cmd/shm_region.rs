//! SHM_REGION: a client on this host hands the server a memory region (a file descriptor passed
//! with the frame over the unix socket), or forgets one. A refusal (a bound reached, a file
//! that is not shared memory, a TCP connection, which passes no descriptors) is an answer, not
//! an error: the client's transfers naming that region go over the stream instead.

use memkv_proto::{self as proto, Header};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_region(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let r = proto::decode_shm_region(body)?;
        // A descriptor passed with this frame arrived with its first bytes.
        let fd = self.io.transport_mut().take_fd();
        let answer = if r.len == 0 {
            drop(fd);
            self.shm.forget(r.id);
            Ok(())
        } else {
            match (&self.ctx.shm, fd) {
                (None, _) => Err("the same-host data path is off on this server".to_string()),
                (Some(_), None) => Err("SHM_REGION without a file descriptor (send it over \
                                        the server's unix socket, with SCM_RIGHTS)"
                    .to_string()),
                (Some(shared), Some(fd)) => self.shm.map(shared, &r, fd),
            }
        };
        let reply = match answer {
            Ok(()) => proto::encode_shm_region_reply(true, ""),
            Err(why) => {
                self.ctx.store.metrics.error("shm_refused");
                if let Some(dropped) = self.ctx.warn.allow() {
                    tracing::warn!(peer = %self.io.transport().peer(), reason = %why,
                        dropped_warnings = dropped, "shared-memory region refused");
                }
                proto::encode_shm_region_reply(false, &why)
            }
        };
        self.reply(h, &reply)
    }
}
