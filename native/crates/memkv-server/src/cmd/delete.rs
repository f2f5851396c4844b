//! DELETE: unlinks keys; memory returns once no transfer holds the value. A key the tenant may
//! not write (outside its prefix, or any key of a read-only tenant) answers FORBIDDEN.

use std::sync::atomic::Ordering;
use std::time::Instant;

use memkv_proto::{self as proto, Header, Status};

use crate::conn::{Conn, End};
use crate::transport::Transport;

impl<T: Transport> Conn<'_, T> {
    pub(crate) fn delete(&mut self, h: &Header, body: &[u8], deadline: Instant) -> Result<(), End> {
        let _share = self.key_share(body, 0, deadline)?;
        let keys = proto::decode_keys(body)?;
        let store = &*self.ctx.store;
        let st: Vec<Status> = (keys.iter())
            .map(|k| match self.may_write(k) {
                true => store.delete(k),
                false => Status::Forbidden,
            })
            .collect();
        store.metrics.deletes.fetch_add(
            st.iter().filter(|s| s.is_ok()).count() as u64,
            Ordering::Relaxed,
        );
        self.reply(h, &proto::encode_statuses(&st))
    }
}
