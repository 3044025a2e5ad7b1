//! A plain-text table: a header row and left-aligned columns two spaces apart, as
//! `kubectl get` and `cilium-dbg service list` print them.

pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            rows: vec![header.iter().map(|h| h.to_string()).collect()],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let width: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for r in &self.rows {
            let mut line = String::new();
            for (c, cell) in r.iter().enumerate() {
                line.push_str(cell);
                if c + 1 < r.len() {
                    line.extend(std::iter::repeat_n(
                        ' ',
                        width[c] - cell.chars().count() + 2,
                    ));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up() {
        let mut t = super::Table::new(&["A", "BB"]);
        t.row(vec!["xxx".into(), "y".into()]);
        assert_eq!(t.render(), "A    BB\nxxx  y\n");
    }
}
