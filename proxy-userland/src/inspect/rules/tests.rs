use super::*;

#[test]
fn words_keep_quoted_comments_whole() {
    assert_eq!(
        words(
            r#"-A KUBE-SERVICES -d 198.19.0.10/32 -m comment --comment "demo/web:http cluster IP" -j X"#
        ),
        [
            "-A",
            "KUBE-SERVICES",
            "-d",
            "198.19.0.10/32",
            "-m",
            "comment",
            "--comment",
            "demo/web:http cluster IP",
            "-j",
            "X"
        ]
    );
}
