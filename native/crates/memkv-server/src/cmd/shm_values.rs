//! SHM_VALUES: a same-host client asks for a read-only descriptor of one lane's value memory
//! (`--shm-share-values`), which it maps to read GET_MAPPED values straight out of it. A refusal
//! (the option off, a TCP connection, which passes no descriptors, a lane that does not exist)
//! is an answer, not an error: the client then reads over the socket as before.

use memkv_proto::{self as proto, Header, ShmValuesReply};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_values(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let lane = proto::decode_shm_values(body)?;
        let store = &*self.ctx.store;
        let lanes = store.lanes().len() as u32;
        let shared = self.ctx.shm.as_deref().is_some_and(|s| s.shares_values());
        let answer = match store.lane_reader_fd(lane as usize) {
            _ if !shared => Err(("the server's value memory is not shared (start it with \
                                 --shm-share-values)")
                .to_string()),
            None => Err(format!("no lane {lane}: the server has {lanes}")),
            Some((_, None)) => Err("the server's value memory is not shared".to_string()),
            Some((_, Some(Err(e)))) => Err(format!("cannot reopen lane {lane} read-only: {e}")),
            Some((len, Some(Ok(fd)))) => match self.io.transport_mut().attach_fd(fd) {
                Ok(()) => Ok(len),
                Err(e) => Err(e.to_string()),
            },
        };
        let rep = match answer {
            Ok(len) => ShmValuesReply {
                lanes,
                len,
                refused: None,
            },
            Err(why) => {
                store.metrics.error("shm_refused");
                ShmValuesReply {
                    lanes,
                    len: 0,
                    refused: Some(why),
                }
            }
        };
        self.reply(h, &proto::encode_shm_values_reply(&rep))
    }
}
