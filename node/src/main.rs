fn main() {
    println!("keyhome {}", env!("CARGO_PKG_VERSION"));
}
