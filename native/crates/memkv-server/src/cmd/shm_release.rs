//! SHM_RELEASE: the client's copies out of a GET_MAPPED reply's values are done; their pins go
//! (`crate::mapped`). The answer says whether the pin set was still held, so the client knows
//! the bytes it copied were the stored ones throughout.

use memkv_proto::{self as proto, Header};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_release(&mut self, h: &Header, body: &[u8]) -> Result<(), End> {
        let pin = proto::decode_shm_release(body)?;
        let held = self.pins.release(pin);
        self.reply(h, &[held as u8])
    }
}
