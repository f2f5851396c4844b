//! A same-host server on a socket file (`--shm-socket PATH`), named to the client by
//! MEMKV_SHM_SOCKET: alone in its test binary, since it sets the process environment.

use std::time::Duration;

use memkv_client::shm_regions::SharedMemory;
use memkv_client::{Buf, Client, ClientConfig, Status, TransportChoice};
use memkv_server::shm::{ShmConfig, ShmSocket};
use memkv_server::{Server, ServerConfig};

fn server_with(shm: ShmConfig) -> std::io::Result<Server> {
    Server::start(ServerConfig {
        listen: "127.0.0.1:0".into(),
        memory: 8 << 20,
        frame_timeout: Duration::from_secs(5),
        shm: Some(shm),
        ..ServerConfig::default()
    })
}

#[test]
fn a_socket_file_is_removed_at_exit_and_a_stale_one_replaced() {
    let dir = std::env::temp_dir().join(format!("memkv-shm-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("memkv.sock");
    // A stale socket file, as a killed server leaves it: nobody answers on it.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let cfg = ShmConfig {
        socket: ShmSocket::Path(path.clone()),
        ..ShmConfig::default()
    };
    let s = server_with(cfg.clone()).unwrap();
    // A second server on the same socket is refused while the first answers.
    let again = server_with(cfg);
    assert!(again.is_err_and(|e| e.to_string().contains("another server answers")));
    std::env::set_var("MEMKV_SHM_SOCKET", &path);
    let c = Client::new(ClientConfig {
        servers: vec![s.addr.to_string()],
        transport: TransportChoice::Shm,
        ..ClientConfig::default()
    })
    .unwrap();
    let mem = SharedMemory::new("memkv-shm-test", 1 << 20).unwrap();
    let ptr = mem.ptr();
    // SAFETY: the mapping outlives the client's use of it.
    unsafe { c.register_memory(ptr, 1 << 20).unwrap() };
    // SAFETY: as above.
    let st = unsafe { c.put(&[b"p".to_vec()], &[Buf { ptr, len: 100 }]) };
    assert_eq!(st, [Status::Ok]);
    assert_eq!(s.shm_mapped_bytes(), 1 << 20);
    s.shutdown();
    s.wait();
    assert!(!path.exists(), "removed at exit");
    std::fs::remove_dir_all(&dir).unwrap();
}
