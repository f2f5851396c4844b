//! SHM_RELEASE: the client's copies out of a GET_MAPPED reply's values are done; their pins go
//! (`crate::mapped`). The answer says whether the client's copies are the stored bytes: 1 when
//! the pin set was held until now and every value matched its checksums (the verification
//! GET_MAPPED started, waited for here until the request's deadline), 2 when a value failed
//! them (it is dropped), 0 for a pin set this connection does not hold or a verdict not known
//! in time.

use std::time::Instant;

use memkv_proto::{self as proto, Header};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn shm_release(
        &mut self,
        h: &Header,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(), End> {
        let pin = proto::decode_shm_release(body)?;
        let answer = match self.pins.release(pin) {
            None => 0,
            Some(set) => match set.verdict.wait(deadline) {
                None => 0,
                Some(intact) if intact.iter().all(|ok| *ok) => 1,
                Some(intact) => {
                    let store = &*self.ctx.store;
                    for ((key, v), ok) in set.keys.iter().zip(&set.values).zip(intact) {
                        if !ok {
                            store.drop_corrupt(key, v);
                        }
                    }
                    2
                }
            },
        };
        self.reply(h, &[answer])
    }
}
