fn main() {
    std::process::exit(memkv_cli::run(std::env::args().collect()));
}
