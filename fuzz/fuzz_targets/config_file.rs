//! A KubeProxyConfiguration file (YAML or JSON) through the path `--config` takes: parsed,
//! merged under the default flags, then validated.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proxy_userland::config::{Args, file::KubeProxyConfiguration};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let cfg = match KubeProxyConfiguration::parse(text, "fuzz.yaml") {
        Ok(cfg) => cfg,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let _ = cfg.ignored_fields();
    let mut args = Args::try_from_iter(["fastpath"]).expect("the defaults are valid");
    let checked = args
        .merge_file(&cfg, "fuzz.yaml", |_| false)
        .and_then(|()| args.validate());
    if let Err(e) = checked {
        let _ = e.to_string();
    }
});
